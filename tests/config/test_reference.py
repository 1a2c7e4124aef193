"""docs/configuration.md is the schema's own reference, regenerated."""

from pathlib import Path

from unison.config.reference import reference_markdown, schema_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_reference_page_matches_the_schema() -> None:
    assert DOC.read_text() == reference_markdown(), (
        "docs/configuration.md is stale: regenerate it with\n"
        "python -c \"from unison.config.reference import reference_markdown; "
        "open('docs/configuration.md','w').write(reference_markdown())\""
    )


def test_every_key_is_documented() -> None:
    rows = schema_reference()
    assert len(rows) > 60
    assert all(doc for _, _, _, doc in rows), [key for key, _, _, doc in rows if not doc]
    keys = {key for key, _, _, _ in rows}
    assert {"training.max_epochs", "parallel.nproc_per_node", "checkpoint.keep_best", "model.type"} <= keys
