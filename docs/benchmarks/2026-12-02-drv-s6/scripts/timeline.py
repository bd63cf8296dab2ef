"""Driver-side timeline of quickstart steps: wall ms of each driver piece per step (median over steps 3..N)."""
import sys, time, statistics, functools
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))
from beamrl.recipe.load import load_recipe
from beamrl.loop.driver import RLDriver
import beamrl.loop.collect as C, beamrl.loop.step as S, beamrl.loop.groups as G, beamrl.loop.driver as D, beamrl.loop.train as T
EV = []
def wrap(mod, name, label):
    f = getattr(mod, name, None)
    if f is None: return
    @functools.wraps(f)
    def w(*a, **k):
        t0 = time.perf_counter(); c0 = time.thread_time()
        try: return f(*a, **k)
        finally: EV.append((label, t0, time.perf_counter(), time.thread_time() - c0))
    setattr(mod, name, w)
wrap(C.RolloutCollector, "start", "collector.start")
wrap(G.EngineGroup, "generate_async", " generate_async(submit)")
wrap(G.EngineGroup, "collect", " engines.collect(wait)")
wrap(S, "score", " rewards(step.score)")
wrap(S, "shape_and_advantages", " advantages")
wrap(C.RolloutCollector, "finish", "collector.finish")
wrap(T, "micro_batches", " build micro-batches")
wrap(G.TrainerGroup, "train_step_then_sync", " trainer call (train+sync)")
wrap(G.TrainerGroup, "train_step", " trainer call (train)")
wrap(G.TrainerGroup, "sync_weights", " trainer call (sync)")
wrap(D.RLDriver, "_train", "driver._train")
wrap(D.RLDriver, "_publish", "driver._publish")
wrap(D.RLDriver, "_show_samples", "driver._show_samples")
STEPS = []
class Drv(RLDriver):
    def __setattr__(self, name, value):
        if name == "ctx" and value is not None:
            orig = value.logger.log
            def log(step, metrics, _o=orig):
                t0 = time.perf_counter(); r = _o(step, metrics); EV.append(("logger.log", t0, time.perf_counter(), 0.0))
                STEPS.append(time.perf_counter()); return r
            value.logger.log = log
        super().__setattr__(name, value)
def main():
    out = Path(sys.argv[1]); n = int(sys.argv[2])
    import shutil; shutil.rmtree(out, ignore_errors=True)
    with Drv(load_recipe(Path("recipes/quickstart.yaml"), [f"run.num_steps={n}", f"run.output_dir={out}"])) as d:
        d.run()
    per = {}
    for i in range(2, len(STEPS) - 1):
        a, b = STEPS[i], STEPS[i + 1]
        tot = {}
        for lab, t0, t1, c in EV:
            if a <= t0 < b:
                w, cc = tot.get(lab, (0, 0)); tot[lab] = (w + t1 - t0, cc + c)
        tot["STEP"] = (b - a, 0)
        for k, v in tot.items(): per.setdefault(k, []).append(v)
    for k in sorted(per, key=lambda k: min(t0 for lab, t0, _, _ in EV if lab == k) if k != "STEP" else 0):
        ws = [x[0] for x in per[k]]; cs = [x[1] for x in per[k]]
        print(f"{k:32s} wall {statistics.median(ws)*1e3:7.1f} ms   driver CPU {statistics.median(cs)*1e3:6.1f} ms")
if __name__ == "__main__": main()
