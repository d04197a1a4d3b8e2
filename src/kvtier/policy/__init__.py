"""Retention policies, reuse predictor, cost model and restore planner: pure logic over a
snapshot (`view.PolicyView`) with time passed in, so the engine and the simulator run the same
objects. See docs/policy.md."""
