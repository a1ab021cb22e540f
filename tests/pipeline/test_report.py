"""The approval request a reviewer reads before a model is published: whatever a metric name, a
metric value or a path holds (user code and ranks write them), it renders as that text, never as a
link, a heading or emphasis. Exact strings of the Markdown, and the HTML a CommonMark renderer
(markdown-it-py, with GitHub's tables and strikethrough) makes of it."""

from __future__ import annotations

from markdown_it import MarkdownIt

from dtrain.pipeline.report import approval_markdown

LINK = "[Approve: model verified](https://evil.example/approve)"
DECISION = {"summary": "gate: publish: rmse 0.4", "metric": "rmse", "value": 0.4}


def html(markdown: str) -> str:
    return MarkdownIt("commonmark").enable("table").enable("strikethrough").render(markdown)


def test_a_path_with_backticks_and_a_carriage_return_stays_one_code_span():
    heldout = f"s3://data/heldout`{LINK}`\r# Gate: PASSED"
    text = approval_markdown({"heldout": heldout, "model_path": "``model`"}, DECISION)
    assert text.endswith(
        "\ntrained model: ``` ``model` ```"
        "\n\nheld-out data: ``s3://data/heldout`[Approve: model verified](https://evil.example/approve)` "
        "# Gate: PASSED``")
    rendered = html(text)
    assert "<a " not in rendered and "<h1>" not in rendered
    assert ("<p>held-out data: <code>s3://data/heldout`[Approve: model verified](https://evil.example/approve)` "
            "# Gate: PASSED</code></p>") in rendered
    assert "<p>trained model: <code>``model`</code></p>" in rendered


def test_a_metric_name_or_text_value_cannot_make_a_link_a_heading_or_emphasis():
    metrics = {LINK: "ok\r# Gate: PASSED", "note": "**ship it** _now_ ~~risk~~ `x` <b>y</b> &amp; \\ |",
               "rmse": 0.4}
    text = approval_markdown({"metrics": metrics}, DECISION)
    assert text.split("\n")[-4:] == [
        "|---|---|",
        "| \\[Approve: model verified\\](https://evil.example/approve) | ok # Gate: PASSED |",
        "| note | \\*\\*ship it\\*\\* \\_now\\_ \\~\\~risk\\~\\~ \\`x\\` &lt;b>y&lt;/b> \\&amp; \\\\ \\| |",
        "| rmse | 0.4 |"]
    rendered = html(text)
    for tag in ("<a ", "<h1>", "<em>", "<s>", "<del>", "<b>"):
        assert tag not in rendered, tag
    assert rendered.count("<strong>") == 1 and rendered.count("<code>") == 0
    assert "<td>[Approve: model verified](https://evil.example/approve)</td>" in rendered
    assert "<td>ok # Gate: PASSED</td>" in rendered
    assert "<td>**ship it** _now_ ~~risk~~ `x` &lt;b&gt;y&lt;/b&gt; &amp;amp; \\ |</td>" in rendered


def test_the_verdict_line_is_text_too():
    text = approval_markdown({}, {"summary": "gate: do not publish** \r\n# Gate: PASSED [ok](https://e.x)"})
    assert text.split("\n")[0] == "**gate: do not publish\\*\\*   # Gate: PASSED \\[ok\\](https://e.x)**"
    assert "<a " not in html(text) and "<h1>" not in html(text)
