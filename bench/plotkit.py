"""What the quality plotting scripts share: matplotlib when it is there, and the rows of
llama_quality CSVs."""
import csv


def pyplot(script):
    """matplotlib.pyplot with the file-only backend, or None (saying so) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{script}: matplotlib is not installed; no plot drawn")
        return None
    return plt


def read_rows(paths):
    """Every row of every CSV in `paths`, as dicts by column name."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    return rows
