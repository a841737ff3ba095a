"""The rlfleet API (group rlfleet.io, version v1alpha1): typed models and the CRDs generated from them."""

from typing import Final

GROUP = "rlfleet.io"
VERSION = "v1alpha1"
# GROUP/VERSION, spelled out so that type checkers see the literal the models declare.
API_VERSION: Final = "rlfleet.io/v1alpha1"
