import statistics, collections
ev = [l.split() for l in open(__import__("sys").argv[1] if len(__import__("sys").argv) > 1 else "step_timestamps.txt")]
steps = []; cur = None
for name, t in ev:
    t = float(t)
    if name == "D_step":
        cur = []; steps.append(cur)
    if cur is not None: cur.append((name, t))
# sort each step by time and compute consecutive deltas by name pair
d = collections.defaultdict(list)
for st in steps[10:-2]:
    st.sort(key=lambda x: x[1])
    for (a, ta), (b, tb) in zip(st, st[1:]):
        d[f"{a}->{b}"].append(tb - ta)
    d["TOTAL"].append(st[-1][1] - st[0][1])
for k, v in d.items():
    print(f"{k:40s} {1e3*statistics.median(v):7.2f} ms  n={len(v)}")
