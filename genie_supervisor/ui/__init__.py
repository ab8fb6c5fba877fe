"""The daemon's own web page (``GET /ui``): its static files, and the live feed it streams from.

The page is plain HTML, CSS and JavaScript under ``static/`` (package data, no build step); the
charting library, uPlot, is fetched from the npm registry by the setup into ``static/vendor/``
(git-ignored, shipped in wheels; ``python -m genie_supervisor.ui.vendor``). Without it the page
works and says the charts are unavailable. docs/ui.md describes the page and its stream.
"""
