"""docs/api.md lists every public name with its current signature and summary."""

from pathlib import Path

from unison.utils.apidoc import MODULES, api_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_api_page_matches_the_package() -> None:
    assert DOC.read_text() == api_markdown(), (
        "docs/api.md is stale: regenerate it with\n"
        "python -c \"from unison.utils.apidoc import api_markdown; open('docs/api.md','w').write(api_markdown())\""
    )


def test_every_public_name_has_a_summary() -> None:
    import importlib
    import inspect

    missing = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if callable(obj) and not (inspect.getdoc(obj) or "").strip():
                missing.append(f"{module_name}.{name}")
    assert missing == []
