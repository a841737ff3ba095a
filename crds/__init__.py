"""The rlfleet API (group rlfleet.io, version v1alpha1): typed models and the CRDs generated from them."""

GROUP = "rlfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
