"""cProfile (thread CPU clock) of the driver's main thread over GRPO steps 2..N of the quickstart."""
import cProfile, pstats, sys, time, io
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))
from beamrl.recipe.load import load_recipe
from beamrl.loop.driver import RLDriver

prof = cProfile.Profile(time.thread_time)
PROF = 'noprof' not in sys.argv
N = int(sys.argv[2]) if len(sys.argv) > 2 else 8
state = {'step': 0, 't': None, 'cpu': None, 'walls': [], 'cpus': [], 'groups': [], 'g': None}
from benchmarks._proc_cpu import ProcessGroups
GROUPS = ProcessGroups({'trainer': 'ray::TrainerActor', 'engine': 'ray::EngineActor'})
class D(RLDriver):
    def __setattr__(self, name, value):
        if name == "ctx" and value is not None:
            lg = value.logger
            orig = lg.log
            def log(step, metrics, _orig=orig):
                r = _orig(step, metrics)
                now, c = time.perf_counter(), time.thread_time()
                if state["step"] == 1: GROUPS.refresh()
                g = GROUPS.sample()
                if state["t"] is not None and state["step"] >= 2:
                    state["walls"].append(now - state["t"]); state["cpus"].append(c - state["cpu"])
                    state["groups"].append({k: (g[k] - state["g"][k]) / 1e9 for k in g})
                state["t"], state["cpu"], state["g"] = now, c, g
                state["step"] += 1
                if state["step"] == 1 and PROF: prof.enable()
                if state["step"] == N: prof.disable()
                return r
            lg.log = log
        super().__setattr__(name, value)

def main():
    out = Path(sys.argv[1]); n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    import shutil; shutil.rmtree(out, ignore_errors=True)
    recipe = load_recipe(Path("recipes/quickstart.yaml"), [f"run.num_steps={n}", f"run.output_dir={out}"])

    with D(recipe) as d:
        d.run()
    prof.disable()
    import statistics
    print("driver main-thread CPU per step (steps 3..N) ms:", [round(c*1e3,1) for c in state["cpus"]], "median", round(statistics.median(state["cpus"])*1e3,2))
    print("wall per step ms:", [round(c*1e3,1) for c in state["walls"]], "median", round(statistics.median(state["walls"])*1e3,1))
    for k in state["groups"][0]:
        print(f"CPU ms per step {k}: median", round(statistics.median(x[k] for x in state["groups"]) * 1e3, 1), [round(x[k]*1e3,1) for x in state["groups"]])
    if not PROF: return
    s = io.StringIO(); st = pstats.Stats(prof, stream=s); st.sort_stats("cumulative"); st.print_stats(60); print(s.getvalue()[:20000])
    s = io.StringIO(); st = pstats.Stats(prof, stream=s); st.sort_stats("tottime"); st.print_stats(40); print(s.getvalue()[:12000])

if __name__ == '__main__':
    main()
