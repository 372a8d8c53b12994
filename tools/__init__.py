"""kvweave's user tools, built on the engine: the CLI, model loading, data, evaluation tasks, training."""
