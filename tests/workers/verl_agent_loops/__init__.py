"""verl 0.9.1's own agent loops, transcribed with only their imports renamed (verl -> pyrl) and their registered
names prefixed with verl_ (see each file's header), and a loop of pyrl's tests' own: tests/workers/
test_verl_agent_loops.py runs them through pyrl's AgentLoopRunner."""
