"""AgentX-style benchmark: SemiAnalysis AgentX / InferenceX semantics on our server (bench/agentx/README.md).

Modules: `tracegen` (synthetic Weka traces), `traces` (Weka files -> session trees, the theoretical
cache), `prompts` (token-exact filler, cache-bust marker, chat messages), `clients` (token-id completions,
chat completions, gRPC), `replay` (N lanes of session trees with AgentX timing), `metrics` (InferenceX
formulas), `plot` (Pareto PNG), `sides` (the day-0 baseline `DAY0` and the other sides), `run` (the A/B CLI,
`python -m bench.agentx`).
"""
