"""OCI images from registries: references, the distribution protocol, the layer store."""
