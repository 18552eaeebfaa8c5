"""Sparse MoE model and its server. Keep this file import-free (importing a submodule such as
`sparsegate_workload.gateparams`, an alias of `sparsegate_contracts.gate`, must not pull in torch)."""
