import torch, time, copy
torch.manual_seed(0)
torch.set_num_threads(1)
shapes=[(64,16)]+[(64,)]*30+[(192,64),(64,64),(16,64),(4,)]*6+[(16,64*32*2),(16,64,32)]*5
ps=[torch.randn(s) for s in shapes]
def run(kind, steps=20):
    params=[torch.nn.Parameter(p.clone()) for p in ps]
    kw=dict(lr=5e-4, betas=(0.9,0.999), eps=1e-8, weight_decay=0.0)
    if kind=="fused": kw["fused"]=True
    elif kind=="foreach": kw["foreach"]=True
    else: kw["foreach"]=False
    opt=torch.optim.Adam(params, **kw)
    g=torch.Generator().manual_seed(1)
    ts=[]
    for i in range(steps):
        for p in params: p.grad=torch.randn(p.shape, generator=g)
        t=time.thread_time(); opt.step(); ts.append(time.thread_time()-t)
    return params, sorted(ts)[len(ts)//2]
a,ta=run("single"); b,tb=run("fused"); c,tc=run("foreach")
print("params", sum(p.numel() for p in a), "tensors", len(a))
print("single ms", ta*1e3, "fused ms", tb*1e3, "foreach", tc*1e3)
print("fused bit-identical:", all(torch.equal(x,y) for x,y in zip(a,b)), max((x-y).abs().max().item() for x,y in zip(a,b)))
print("foreach bit-identical:", all(torch.equal(x,y) for x,y in zip(a,c)))
