"""The generated CRDs and API reference: committed copies current, schemas structural, rules well-placed."""
from __future__ import annotations

import pytest
import yaml

from rlfleet.crds.crd import all_crds, openapi_schema
from rlfleet.crds.generate import CRD_DIR, DOCS_PATH, generated_files
from rlfleet.crds.generate import main as generate_main
from rlfleet.crds.miles_flags import MILES_FLAGS, NO_DEFAULT
from rlfleet.crds.models import KINDS, TrainingRun
from rlfleet.crds.schema import walk
from rlfleet.util.generated import stale_files

FORBIDDEN = ("$ref", "$defs", "anyOf", "allOf", "oneOf", "not", "title", "const", "nullable")


def test_committed_files_match_the_models():
    stale = stale_files(generated_files())
    assert not stale, f"run `make crds`: {[str(p) for p in stale]} differ from what the models generate"


def test_generate_check_mode_reports_a_stale_file(tmp_path, capsys):
    files = generated_files(tmp_path / "crds", tmp_path / "api-reference.md")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    args = ["--check", "--crd-dir", str(tmp_path / "crds"), "--docs", str(tmp_path / "api-reference.md")]
    assert generate_main(args) == 0
    (tmp_path / "crds" / "trainingruns.yaml").write_text("# hand edited\n")
    assert generate_main(args) == 1
    assert "trainingruns.yaml" in capsys.readouterr().err
    assert generate_main(args[1:]) == 0 and generate_main(args) == 0  # writing repairs it


def test_one_crd_per_kind_with_names_columns_and_subresources():
    docs = {kind.kind: doc for kind, doc in all_crds()}
    assert sorted(p.name for p in CRD_DIR.glob("*.yaml")) == ["evalfleets.yaml", "rolloutfleets.yaml",
                                                              "trainingruns.yaml"]
    run = docs["TrainingRun"]["spec"]
    assert run["names"]["shortNames"] == ["tr"] and run["names"]["categories"] == ["rlfleet"]
    columns = [c["name"] for c in run["versions"][0]["additionalPrinterColumns"]]
    assert columns[:5] == ["Phase", "Step", "Weights", "Ready", "Last Eval"] and columns[-1] == "Age"
    assert run["versions"][0]["subresources"] == {"status": {}, "scale": {  # the run's rollout fleet
        "specReplicasPath": ".spec.rollout.replicas", "statusReplicasPath": ".status.rolloutReplicas",
        "labelSelectorPath": ".status.rolloutSelector"}}
    for kind, short in (("RolloutFleet", "rf"), ("EvalFleet", "ef")):
        spec = docs[kind]["spec"]
        assert spec["names"]["shortNames"] == [short]
        assert spec["versions"][0]["subresources"]["scale"] == {
            "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_schemas_are_structural(kind):
    for path, node in walk(openapi_schema(kind)):
        assert not set(node) & set(FORBIDDEN), f"{path}: {set(node) & set(FORBIDDEN)}"
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        assert node.get("additionalProperties") is not False, path
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: lists need maxItems (bounded CEL cost)"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_numeric_bounds_are_whole_numbers(kind):
    # The API server truncates a fractional bound when the value is an integer (0 passes minimum 0.1).
    for path, node in walk(openapi_schema(kind)):
        for key in ("minimum", "maximum"):
            if key in node:
                assert float(node[key]).is_integer(), f"{path}.{key} = {node[key]}"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_every_rule_points_at_a_field_of_its_object(kind):
    for path, node in walk(openapi_schema(kind)):
        for rule in node.get("x-kubernetes-validations", []):
            target = node
            for part in rule.get("fieldPath", "").split(".")[1:]:
                assert part in target.get("properties", {}), f"{path}: fieldPath {rule['fieldPath']} is not a field"
                target = target["properties"][part]
            assert rule["message"] and rule["rule"]


def test_defaults_in_the_schema_are_what_the_models_fill_in():
    # A minimal run defaulted by the models equals the schema's own defaults, field by field.
    minimal = TrainingRun.model_validate(
        {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun", "spec": {"modelPath": "tiny://llama"}}
    )
    spec = minimal.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    schema = openapi_schema(KINDS[0])["properties"]["spec"]
    for key, node in schema["properties"].items():
        if "default" in node:
            assert spec[key] == node["default"], key


def test_rule_and_field_counts_are_substantial():
    schema = openapi_schema(KINDS[0])
    fields = [p for p, _ in walk(schema["properties"]["spec"], "spec") if not p.endswith(("[]", "{}"))]
    rules = [r for _, n in walk(schema) for r in n.get("x-kubernetes-validations", [])]
    assert len(fields) > 150 and len(rules) >= 20


def _schema_node(path: str) -> dict:
    node = openapi_schema(KINDS[0])
    for part in path.split("."):
        if part.endswith("[]"):
            node = node["properties"][part[:-2]]["items"]
        else:
            node = node["properties"][part]
    return node


@pytest.mark.parametrize("mapping", [m for m in MILES_FLAGS if m.field], ids=lambda m: m.field)
def test_every_miles_setting_has_its_field_and_default(mapping):
    node = _schema_node(mapping.field)
    if mapping.default is not NO_DEFAULT:
        assert node.get("default") == mapping.default


def test_api_reference_lists_every_field_with_its_default():
    text = DOCS_PATH.read_text()
    assert "| `spec.heatGuard.pauseAtC` | number | `84.0` | ≥ 0, ≤ 150 |" in text
    assert "`spec.heatGuard.resumeAtC` | resumeAtC must be below pauseAtC" in text
    for path, _node in walk(openapi_schema(KINDS[0])["properties"]["spec"], "spec"):
        if not path.endswith(("[]", "{}")) and path != "spec":
            assert f"| `{path}` |" in text, path


def test_crd_yaml_round_trips():
    for path in CRD_DIR.glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        assert doc["apiVersion"] == "apiextensions.k8s.io/v1" and doc["kind"] == "CustomResourceDefinition"
