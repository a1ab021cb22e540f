"""Provider metadata and the plugin, as an installed package shows them to Airflow.

* get_provider_info() conforms to Airflow's own runtime schema (provider_info.schema.json);
* the real CLI lists our trigger module, our three extra links and our plugin;
* the ``airflow.plugins`` entry point alone registers the plugin (empty plugins folder), and
  with the repo's plugins/ folder active too (as in this test session) there is still one
  plugin and no "already registered" import error;
* plugins/dtrain_plugin.py still registers the plugin for folder-based deployments, i.e.
  when no entry point is installed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import jsonschema
import pytest

from dtrain.provider import get_provider_info

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
PACKAGE = "airflow-dtrain"
LINK_CLASSES = {"dtrain.launch.airflow.links.CheckpointLink", "dtrain.launch.airflow.links.TrainingLink",
                "dtrain.launch.airflow.links.TensorBoardLink"}
MACROS = {"dtrain.training.scaling.scaled_lr", "dtrain.plugin.global_batch_size"}
ENTRY_POINT = "dtrain.plugin:DTrainPlugin"


def _airflow_schema(name: str) -> dict:
    """A JSON schema shipped inside the installed airflow package (found without importing it)."""
    (location,) = importlib.util.find_spec("airflow").submodule_search_locations[:1]
    with open(os.path.join(location, name)) as f:
        return json.load(f)


def _airflow_cli(*args: str, env: dict | None = None) -> list:
    out = subprocess.run([os.path.join(BIN, "airflow"), *args, "-o", "json"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


# --- metadata --------------------------------------------------------------------------------

def test_provider_info_validates_against_airflows_schema():
    info = get_provider_info()
    schema = _airflow_schema("provider_info.schema.json")
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    validator_cls(schema).validate(info)  # what ProvidersManager runs on load

    assert info["package-name"] == PACKAGE
    assert set(info["extra-links"]) == LINK_CLASSES
    assert [m for t in info["triggers"] for m in t["python-modules"]] == ["dtrain.launch.airflow.trigger"]

    # Integrations: the stricter provider.yaml schema's rules (required fields, known tags), and
    # every integration-name that operators/triggers reference is declared.
    integration_schema = _airflow_schema("provider.yaml.schema.json")["properties"]["integrations"]
    jsonschema.validate(info["integrations"], integration_schema)
    declared = {i["integration-name"] for i in info["integrations"]}
    referenced = {e["integration-name"] for key in ("operators", "triggers") for e in info[key]}
    assert referenced and referenced <= declared

    # Every declared module exists (not imported: operator modules are free to be heavier).
    for key in ("operators", "triggers"):
        for entry in info[key]:
            for module in entry["python-modules"]:
                assert importlib.util.find_spec(module) is not None, module


def test_declared_links_are_the_plugins_links():
    from airflow.sdk import BaseOperatorLink

    from dtrain.launch.airflow.links import LINKS
    from dtrain.plugin import DTrainPlugin

    for path in get_provider_info()["extra-links"]:
        module, _, name = path.rpartition(".")
        assert issubclass(getattr(importlib.import_module(module), name), BaseOperatorLink), path
    plugin_links = {f"{type(link).__module__}.{type(link).__qualname__}" for link in DTrainPlugin.operator_extra_links}
    assert plugin_links == LINK_CLASSES and DTrainPlugin.operator_extra_links is LINKS


# --- the real CLI ----------------------------------------------------------------------------

def test_cli_lists_the_trigger():
    rows = [r for r in _airflow_cli("providers", "triggers") if r["package_name"] == PACKAGE]
    assert rows == [{"package_name": PACKAGE, "class": "dtrain.launch.airflow.trigger",
                     "integration_name": "Distributed training"}]
    # The listed module defines the deferrable operator's trigger class (read, not imported:
    # the CLI does not import it either, and its internals may be mid-refactor).
    with open(importlib.util.find_spec(rows[0]["class"]).origin) as f:
        tree = ast.parse(f.read())
    bases = {node.name: [ast.unparse(b) for b in node.bases] for node in tree.body if isinstance(node, ast.ClassDef)}
    assert "BaseTrigger" in bases.get("DistributedJobTrigger", []), bases


def test_cli_lists_the_extra_links():
    names = {r["extra_link_class_name"] for r in _airflow_cli("providers", "links")}
    assert LINK_CLASSES <= names


def _assert_dtrain_plugin(plugins: list) -> dict:
    ours = [p for p in plugins if p["name"] == "dtrain"]
    assert len(ours) == 1, plugins
    plugin = ours[0]
    assert set(plugin["macros"]) == MACROS
    assert set(plugin["operator_extra_links"]) == {f"<{c} object>" for c in LINK_CLASSES}
    # Airflow's EntryPointSource: "<dist>==<version>: EntryPoint(name=..., value=..., group=...)".
    assert plugin["source"].startswith(f"{PACKAGE}=="), plugin["source"]
    assert f"value='{ENTRY_POINT}'" in plugin["source"] and "group='airflow.plugins'" in plugin["source"]
    return plugin


def test_cli_lists_the_plugin():
    # This session's plugins folder is the repo's plugins/: both registration paths are active.
    assert os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] == os.path.join(REPO, "plugins")
    _assert_dtrain_plugin(_airflow_cli("plugins"))


def test_entry_point_alone_registers_the_plugin(tmp_path):
    empty = tmp_path / "plugins"
    empty.mkdir()
    env = {**os.environ, "AIRFLOW__CORE__PLUGINS_FOLDER": str(empty)}
    _assert_dtrain_plugin(_airflow_cli("plugins", env=env))


def test_plugins_folder_and_entry_point_do_not_clash():
    """Airflow loads the folder first and skips a same-named plugin with an import error."""
    code = ("import json; from airflow import plugins_manager as pm; plugins, errors = pm._get_plugins(); "
            "print(json.dumps({'names': [p.name for p in plugins], 'errors': errors}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["names"].count("dtrain") == 1
    assert result["errors"] == {}, result["errors"]


# --- folder-based deployments ----------------------------------------------------------------

@pytest.mark.parametrize("entry_point_installed", [True, False])
def test_plugins_folder_file_registers_only_without_the_entry_point(entry_point_installed, monkeypatch):
    from airflow._shared.plugins_manager import _load_plugins_from_plugin_directory

    import dtrain.plugin

    if not entry_point_installed:
        monkeypatch.setattr(dtrain.plugin, "registered_by_entry_point", lambda: False)
    else:
        assert dtrain.plugin.registered_by_entry_point()  # this venv's editable install
    monkeypatch.delitem(sys.modules, "dtrain_plugin", raising=False)  # the loader puts it there
    folder = os.path.join(REPO, "plugins")
    plugins, errors = _load_plugins_from_plugin_directory(plugins_folder=folder)
    monkeypatch.delitem(sys.modules, "dtrain_plugin", raising=False)

    assert errors == {}
    if entry_point_installed:
        assert plugins == []
    else:
        assert [(type(p), str(p.source)) for p in plugins] == [
            (dtrain.plugin.DTrainPlugin, "$PLUGINS_FOLDER/dtrain_plugin.py")]


def test_plugin_and_provider_imports_stay_cheap():
    from tests.support import heavy_libraries_imported_by

    assert heavy_libraries_imported_by("dtrain.provider", "dtrain.plugin") == []
