"""Training for sparsegate's MoE models: a synthetic corpus made in code (`corpus`), the
entropy-regularised, load-balanced training loop, held-out evaluation and checkpoint writing
(`trainer`), the ``sparsegate-train`` command (`cli`) and a stdlib PNG scatter plot for the
Pareto benchmark (`png_plot`). Kept import-free: torch and transformers load on use."""
