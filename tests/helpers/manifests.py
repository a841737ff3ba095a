"""A minimal TrainingRun manifest and the loader's errors for it, for the tests of API rules."""
from __future__ import annotations

from rlfleet.crds.loader import load_text

RUN = """\
apiVersion: rlfleet.io/v1alpha1
kind: TrainingRun
metadata: {name: t}
spec:
  modelPath: tiny://llama
"""


def errors(text: str) -> list[tuple[str, str]]:
    """(field path, message) of every error the loader finds in the one document of `text`."""
    (doc,) = load_text(text)
    return [(e.path, e.message) for e in doc.errors]
