"""A compact serving engine for measurement: model, runner, scheduler, step loop, systems."""
