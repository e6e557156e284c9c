"""Sphinx configuration of the self-study book (MyST-NB renders the executed labs; see book/build.py).

The sources Sphinx reads are staged by book/build.py into book/_build/src; this folder is only the
configuration. Build with launchers/book.
"""

project = "Distributed Training Labs"
author = "the course"
copyright = "the course authors"

# sphinx-mathjax-offline ships MathJax 3 and points Sphinx at it: formulas render without a network.
extensions = ["myst_nb", "sphinx-mathjax-offline"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# Formulas: $...$ and $$...$$ as in the notebooks, rendered by MathJax.
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# Executions: cached in jupyter-cache (keyed by the code cells), so editing one lab re-executes only that
# lab. book/build.py sets the cache folder. A solution that raises fails the build.
nb_execution_mode = "cache"
nb_execution_timeout = 900
nb_execution_in_temp = True
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
# Widgets are drawn once, statically, when nobody can move them (lablib.course.plots.explore); the figure is what shows.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]

html_theme = "sphinx_book_theme"
html_title = "Distributed Training Labs"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "home_page_in_toc": True,
    "navigation_with_keys": True,
}
html_show_sourcelink = False
# The staged sources hold the grader's hidden tests (removed from the pages, still executed): never publish them
# (no _sources/ folder, and the download button offers only the page's PDF, not its .ipynb).
html_copy_source = False
# Model answers folded (native <details>, no script needed; open in print), code that wraps instead of being cut.
html_static_path = ["_static"]
html_css_files = ["book.css"]
html_js_files = ["book.js"]
suppress_warnings = ["mystnb.unknown_mime_type"]


def _print_button_only(app, pagename, templatename, context, doctree):
    """The theme's download menu without its source links (_sources/ is not published): 'Print to PDF' only."""
    for group in context.get("header_buttons", []):
        if group.get("label") == "download-buttons":
            group["buttons"] = [b for b in group["buttons"]
                                if b.get("label") not in ("download-source-button", "download-notebook-button")]


def setup(app):
    # After sphinx-book-theme's own handler (priority 501) has added the buttons.
    app.connect("html-page-context", _print_button_only, priority=900)
