"""What a data file's rows must agree on before datasets reads them (hf_zero.data.sources.verify_data_file runs
these as it parses each row): one format per file, and CSV that parses strictly. Both were silent before: datasets
gives every row every column, and pandas merges rows after an unterminated quote or shifts columns after an unquoted
comma."""

from __future__ import annotations

from hf_zero.core.errors import UserError

__all__ = ["RowKinds", "verify_csv"]


class RowKinds:
    """Rows of one file must share one format: datasets gives every row every column (None where a row lacks it),
    so a chat row among text rows trained an empty text, or failed after launch blaming row 1. Each row's format
    read from its own columns, as detect_format reads a file's (the default column names)."""

    _KINDS = (("chat messages", ("messages",)), ("chat messages", ("conversations",)),
              ("prompt + completion", ("prompt", "completion")), ("text", ("text",)))

    def __init__(self, spec: str, where: str, unit: str = "row"):
        self.spec, self.where, self.unit, self.first = spec, where, unit, None

    def add(self, row: int, value: dict) -> None:
        kind = next((name for name, cols in self._KINDS if all(c in value for c in cols)), None)
        if kind is None:
            return
        if kind == "text" and not isinstance(value["text"], (str, type(None))):  # trained as its str() before
            raise UserError(self.where, f"{self.spec} {self.unit} {row}: text is a JSON "
                            f"{type(value['text']).__name__} ({str(value['text'])[:40]}), not a string",
                            "give text as a string in every row")
        if self.first is None:
            self.first = (row, kind)
        elif kind != self.first[1]:
            raise UserError(self.where, f"{self.spec} {self.unit} {row}: {kind}, but {self.unit} {self.first[0]} is "
                            f"{self.first[1]} (one file holds one format)",
                            "put each format in its own file (a stage may list both, or use separate stages)")


def verify_csv(text: str, spec: str, where: str) -> None:
    """An unterminated quote makes the CSV reader take every line after it as one field: rows silently merged."""
    import csv
    import io

    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    start, width = 1, None  # the line the record being read starts on (a quoted field may span lines)
    try:
        for row in reader:
            width = len(row) if width is None else width
            if len(row) > width:  # pandas would take the extra leading fields as an index: columns shifted
                raise UserError(where, f"{spec} line {start}: {len(row)} fields, the header has {width}",
                                "quote fields that hold a comma, or fix the row")
            start = reader.line_num + 1
    except csv.Error as err:
        raise UserError(where, f"{spec} line {start}: not valid CSV ({err})",
                        'close the quote (a quote inside a field is written twice: "")') from None
