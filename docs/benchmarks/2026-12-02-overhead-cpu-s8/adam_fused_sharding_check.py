import torch
torch.manual_seed(0); torch.set_num_threads(1)
N=1000003
p0=torch.randn(N); 
def run(chunks):
    params=[torch.nn.Parameter(c.clone()) for c in torch.split(p0.clone(), chunks)]
    opt=torch.optim.Adam(params, lr=5e-4, fused=True)
    g=torch.Generator().manual_seed(1)
    for i in range(10):
        G=torch.randn(N, generator=g)
        for p,gg in zip(params, torch.split(G, chunks)): p.grad=gg.clone()
        opt.step()
    return torch.cat([p.detach() for p in params])
a=run(N); b=run([7,13,1000003-20]); c=run(333)
print(torch.equal(a,b), torch.equal(a,c))
