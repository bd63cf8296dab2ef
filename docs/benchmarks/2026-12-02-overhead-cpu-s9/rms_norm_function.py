"""`numerics.rms_norm` (autograd's ~6 backward nodes) against one autograd Function whose backward writes out the
same formulas (bit-identical, checked over fp32/bf16 and the trainer's shapes), and against `F.rms_norm` (also
bit-identical: on CPU it decomposes into the same ops): microseconds per forward + backward of [423, 64]."""
import torch, time
torch.set_num_threads(1)
import torch.nn.functional as F
from beamrl.models.beam.numerics import rms_norm

class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        y = xf * r
        wf = weight.float()
        out = (y * wf).to(x.dtype)
        ctx.save_for_backward(xf, r, y, wf)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.wshape = weight.shape
        return out

    @staticmethod
    def backward(ctx, go):
        xf, r, y, wf = ctx.saved_tensors
        xdt, wdt = ctx.dtypes
        go = go.float() if go.dtype != torch.float32 else go   # ToCopyBackward of .to(x.dtype)
        gx = gw = None
        gy = go * wf
        if ctx.needs_input_grad[1]:
            gw = (go * y).sum_to_size(wf.shape)
            gw = gw.to(wdt) if wdt != torch.float32 else gw
        if ctx.needs_input_grad[0]:
            gx1 = gy * r
            gr = (gy * xf).sum_to_size(r.shape)
            gm = -0.5 * gr * r.pow(3)
            n = xf.shape[-1]
            gsq = gm.expand(xf.shape) / n
            gx2 = gsq * (2.0 * xf.pow(1.0))
            gx = gx1 + gx2
            gx = gx.to(xdt) if xdt != torch.float32 else gx
        return gx, gw, None

torch.manual_seed(0)
ok=True
for shape in [(423,64),(423,4,16),(423,2,16),(64,1,64),(7,64),(1,423,64)]:
  for dt in (torch.float32, torch.bfloat16):
    x=(torch.randn(*shape)*3).to(dt).requires_grad_(); w=(1+0.1*torch.randn(shape[-1])).to(dt).requires_grad_()
    a=rms_norm(x,w,1e-6); b=RMSNormFn.apply(x,w,1e-6)
    g=torch.randn_like(a)
    ga=torch.autograd.grad(a,(x,w),g); gb=torch.autograd.grad(b,(x,w),g)
    e=(torch.equal(a,b), torch.equal(ga[0],gb[0]), torch.equal(ga[1],gb[1]))
    ok &= all(e)
    print(shape, dt, e, (ga[0].float()-gb[0].float()).abs().max().item())
print("all equal", ok)
x=torch.randn(423,64,requires_grad=True); w=torch.randn(64,requires_grad=True); g=torch.randn(423,64)
for f,name in ((lambda: rms_norm(x,w,1e-6),'numerics.rms_norm'),(lambda: RMSNormFn.apply(x,w,1e-6),'one Function'),
               (lambda: F.rms_norm(x,(64,),w,1e-6),'F.rms_norm'))*2:
  for _ in range(100): f().backward(g)
  t=time.perf_counter()
  for _ in range(1000): f().backward(g)
  print(name, '%.1f us fwd+bwd'%((time.perf_counter()-t)/1000*1e6))
