"""numerics.rms_norm vs F.rms_norm, forward + backward, 8 alternating rounds of 300 calls (CPU us per call); then
the ops F.rms_norm runs on CPU (aten::_fused_rms_norm is a composite of the same ops)."""
import torch, time
import torch.nn.functional as F
torch.set_num_threads(1)
from beamrl.models.beam.numerics import rms_norm
from torch.profiler import profile
def bench(f, g, n=300):
    for _ in range(30): f().backward(g)
    t=time.thread_time()
    for _ in range(n): f().backward(g)
    return (time.thread_time()-t)/n*1e6
for shape in [(423,64),(423,4,16)]:
    x=torch.randn(*shape,requires_grad=True); w=torch.randn(shape[-1],requires_grad=True); g=torch.randn(*shape)
    a=lambda: rms_norm(x,w,1e-6); b=lambda: F.rms_norm(x,(shape[-1],),w,1e-6)
    ra,rb=[],[]
    for _ in range(8):
        ra.append(bench(a,g)); rb.append(bench(b,g))
    print(shape, "numerics min %.0f med %.0f | F min %.0f med %.0f us"%(min(ra),sorted(ra)[4],min(rb),sorted(rb)[4]))
x=torch.randn(423,64,requires_grad=True); w=torch.randn(64,requires_grad=True); g=torch.randn(423,64)
with profile() as p:
    F.rms_norm(x,(64,),w,1e-6).backward(g)
print(p.key_averages().table(sort_by='count', row_limit=30))
