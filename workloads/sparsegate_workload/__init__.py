"""Sparse MoE model and its server. Keep this file import-free: the operator imports
`sparsegate_workload.gateparams` and must not pull in torch."""
