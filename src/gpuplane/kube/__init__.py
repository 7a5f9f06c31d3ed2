"""The Kubernetes world: the cluster port over the API, the scheduler extender, admission, the operator."""
