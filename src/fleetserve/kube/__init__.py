"""The Kubernetes backend: a cluster's stack, its replicas as objects, apply and import."""
