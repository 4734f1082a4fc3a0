"""Small helpers under verl 0.9.1's module paths (`verl.utils.profiler`, `verl.utils.rollout_trace`), so that verl
agent-loop files run with only their package name changed."""
