"""One MoE layer's routed experts at the quickstart's size (423 tokens, top-4 of 16, H 64, I 32), forward +
backward: the trainer's eager path (`eager_grouped_experts`: grouped GEMMs, per-expert inside) against a padded
`bmm` over [E, capacity, H] (a dense-expert layout): ms per call, and which results stay bit-identical."""
import time, torch
torch.set_num_threads(1)
from beamrl.kernels.grouped_experts import eager_grouped_experts, sort_by_expert
from beamrl.models.beam import numerics
torch.manual_seed(0)
T,k,E,H,I=423,4,16,64,32
x=torch.randn(T,H,requires_grad=True)
ids=torch.stack([torch.randperm(E)[:k] for _ in range(T)])
w=torch.rand(T,k,requires_grad=True)
gu=(torch.randn(E,2*I,H)*0.1).requires_grad_()
dn=(torch.randn(E,H,I)*0.1).requires_grad_()
g=torch.randn(T,H)
def cur():
    out=eager_grouped_experts(x,ids,w,gu,dn,2.5); out.backward(g); return out
def padded():
    order,tokens,counts,inverse=sort_by_expert(ids,E)
    sizes=counts.tolist(); C=max(sizes)
    # slot index within expert
    starts=torch.cumsum(counts,0)-counts
    e_sorted=ids.reshape(-1)[order]
    pos=torch.arange(order.numel())-starts[e_sorted]
    dest=e_sorted*C+pos
    xs=x.new_zeros(E*C,H).index_copy(0,dest,x.index_select(0,tokens))
    xs=xs.view(E,C,H)
    gate_up=torch.bmm(xs,gu.transpose(1,2))
    act=numerics.swiglu(gate_up[...,:I],gate_up[...,I:])
    acc=torch.bmm(act,dn.transpose(1,2)).view(E*C,H).index_select(0,dest)
    ws=w.reshape(-1).index_select(0,order)
    y=(acc*ws.unsqueeze(-1))
    out=numerics.moe_combine(y.index_select(0,inverse).view(T,k,H),2.5)
    out.backward(g); return out
res={}
for name,f in (("cur",cur),("padded",padded)):
    for p in (x,w,gu,dn): p.grad=None
    o=f(); res[name]=(o.detach().clone(),[p.grad.clone() for p in (x,w,gu,dn)])
    ts=[]
    for _ in range(30):
        for p in (x,w,gu,dn): p.grad=None
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    print(name, "min ms %.2f median %.2f"%(min(ts)*1e3, sorted(ts)[15]*1e3))
a,b=res["cur"],res["padded"]
print("out equal", torch.equal(a[0],b[0]), (a[0]-b[0]).abs().max().item())
for n,ga,gb in zip("x w gu dn".split(),a[1],b[1]): print(n, torch.equal(ga,gb), (ga-gb).abs().max().item())
from torch.profiler import profile
for name,f in (("cur",cur),("padded",padded)):
    with profile() as p:
        for _ in range(10):
            for q in (x,w,gu,dn): q.grad=None
            f()
    print(name); print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
