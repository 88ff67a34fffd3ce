"""The paper's report from result folders: `python -m isojax.report RESULTS... --out DIR`.

`collect` finds and loads results (also used by `isojax.correlate`), `states` and `matrices`
build the figure sections, `correlation` the Table-1 section, `render` writes HTML and
Markdown, `build` puts it together. Nothing is imported here, so that `isojax.correlate` can
use `collect` without loading the rest.
"""
