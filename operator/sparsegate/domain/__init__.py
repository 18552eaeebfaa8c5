"""Pure domain logic: rendering, gate resolution, conditions. No Kopf, Kubernetes or HTTP here."""
