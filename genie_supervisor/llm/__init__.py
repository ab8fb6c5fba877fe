"""The serving path: everything between a request and the engine.

`manager` (ModelManager: model roles, memory-budgeted loading, swapping, leases) over the serving
backends (`serving`: the Backend protocol and its factory; `builtin`: the engine in this process
through `host.EngineHost` and `generation.HostedGeneration`; `llama_cpp`: an external llama-server),
with `admission` (priority classes, queues, deadlines) in front. The API routes and the MQTT
commands reach the LLM only through these.
"""
