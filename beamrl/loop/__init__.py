"""The RL loop: `beamrl train RECIPE` (driver, Ray actors, rollout -> reward -> train -> sync)."""


class TrainerRankLost(RuntimeError):
    """A trainer rank died: the run stopped; the one-line message names the rank and the checkpoint to resume from
    (`beamrl train` prints it and exits 1)."""


def run_training(recipe, resume: bool = False, overwrite: bool = False, verbose: bool = False):
    """Run a recipe to completion (see `beamrl.loop.driver.RLDriver`); returns the run's output directory.
    `resume`: continue the run in its output directory; `overwrite`: delete an earlier run's outputs there first;
    `verbose`: show third-party warnings (once per process)."""
    from beamrl.loop.driver import RLDriver

    with RLDriver(recipe, resume=resume, overwrite=overwrite, verbose=verbose) as driver:
        return driver.run()
