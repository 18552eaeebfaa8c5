"""Training for sparsegate's MoE models: a synthetic corpus made in code (`corpus`), the
entropy-regularised, load-balanced training loop and held-out evaluation (`trainer`), and the
``sparsegate-train`` command (`cli`). Kept import-free: torch and transformers load on use."""
