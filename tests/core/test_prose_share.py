"""The package's docstrings and comments stay a bounded share of its lines: contracts in
docstrings, design in the per-folder READMEs and docs/, measurements in docs/performance.md."""

import ast
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torch_msa"
PROSE_BUDGET = 0.22


def prose_lines(text: str) -> tuple[int, int]:
    """`(non-blank lines, docstring and comment lines among them)` of one Python source."""
    lines = text.splitlines()
    nonblank = {number for number, line in enumerate(lines, 1) if line.strip()}
    prose = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(text).readline)
             if token.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        # Docstrings, and attribute docstrings (a string statement after an assignment).
        for position, statement in enumerate(body):
            is_string = (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
                         and isinstance(statement.value.value, str))
            documents = position == 0 and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                            ast.AsyncFunctionDef))
            after_assignment = position > 0 and isinstance(body[position - 1], (ast.Assign, ast.AnnAssign))
            if is_string and (documents or after_assignment):
                prose.update(range(statement.lineno, statement.end_lineno + 1))
    return len(nonblank), len(prose & nonblank)


def test_the_counter_counts_docstrings_comments_and_attribute_docstrings():
    source = '"""Module."""\n\nX = 1\n"""X\'s docstring."""\n\n\ndef f():\n    # why\n    return "not prose"\n'
    assert prose_lines(source) == (6, 3)


def test_docstrings_and_comments_stay_within_the_budget():
    counted = [prose_lines(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))]
    lines, prose = sum(n for n, _ in counted), sum(p for _, p in counted)
    assert prose / lines <= PROSE_BUDGET, (
        f"docstrings and comments are {prose / lines:.1%} of the package's {lines} non-blank lines "
        f"(budget {PROSE_BUDGET:.0%}): state contracts in docstrings, move design notes to the folder's README")
