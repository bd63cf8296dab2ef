"""The RL loop: `beamrl train RECIPE` (driver, Ray actors, rollout -> reward -> train -> sync)."""


def run_training(recipe, resume: bool = False):
    """Run a recipe to completion (see `beamrl.loop.driver.RLDriver`); returns the run's output directory."""
    from beamrl.loop.driver import RLDriver

    with RLDriver(recipe, resume=resume) as driver:
        return driver.run()
