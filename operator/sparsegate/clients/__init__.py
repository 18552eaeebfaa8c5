"""Side effects: the Kubernetes API (and, from other features, OPA and pod admin HTTP)."""
