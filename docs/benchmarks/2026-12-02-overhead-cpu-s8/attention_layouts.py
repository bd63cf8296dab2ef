import torch, time, pickle, statistics, sys
sys.path.insert(0,'.')
torch.set_num_threads(1)
from beamrl.kernels.packed_attention import packed_attention
from beamrl.models.beam import numerics
(ga, gk) = pickle.loads(open('/tmp/ps1/capture/grpo_train_step.pkl','rb').read())
mb = ga[0][0]
cu = mb.cu_seqlens.tolist()
lens=[b-a for a,b in zip(cu[:-1],cu[1:])]
print("T", cu[-1], "seqs", len(lens), "length counts", {l: lens.count(l) for l in sorted(set(lens))})
T=cu[-1]
def bench(bounds, fn, n=200):
    q=torch.randn(T,4,16,requires_grad=True); k=torch.randn(T,2,16,requires_grad=True); v=torch.randn(T,2,16,requires_grad=True)
    ts=[]
    for i in range(n):
        t=time.thread_time(); o=fn(q,k,v,bounds); o.sum().backward(); ts.append(time.thread_time()-t)
    return 1e3*min(ts), 1e3*statistics.median(ts)
cur = lambda q,k,v,b: packed_attention(q,k,v,b,8)
sl = sorted(lens); sb=[0]
for l in sl: sb.append(sb[-1]+l)
L=max(lens)
def padded(q,k,v,b):
    n=len(lens)
    # gather into [n, L] with padding index T (zero row)
    idx=torch.full((n,L), T, dtype=torch.long)
    for i,(a,e) in enumerate(zip(b[:-1],b[1:])): idx[i,:e-a]=torch.arange(a,e)
    z=lambda t: torch.cat([t, t.new_zeros(1,*t.shape[1:])])
    qq,kk,vv=(z(t)[idx] for t in (q,k,v))
    pos=torch.arange(L)
    m=numerics.sliding_window_mask(pos,pos,8)
    o=numerics.attention(qq,kk,vv,m)
    return o.reshape(n*L,*o.shape[2:])[ (idx<T).view(-1) ]
for name, fn, b in (("current", cur, cu), ("sorted", cur, sb), ("padded", padded, cu)):
    print(name, "min/median ms per layer fwd+bwd", ["%.3f"%x for x in bench(b, fn)])
