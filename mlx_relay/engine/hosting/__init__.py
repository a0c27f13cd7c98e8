"""Where the engine runs and how its commands reach it: the `EngineHandle` the GPUExecutor holds,
the engine on a thread of this process (`local_engine`, `gpu_thread`), in a process of its own
(`engine_process` <-> `process_main`, frames of `wire`), and over a pipeline of ranks
(`pipeline_boot`, `pipeline_sync`, `pipeline_watch`). Imports nothing on its own: the process
host's modules import no MLX, and the server imports only those when the engine runs apart."""
