"""The web console on the admin port: the page and its assets (`static/`), and the live charts' data (`series.py`).

Every asset ships in the package (machines serving a pool may have no internet): plain HTML, CSS and
JavaScript, no framework, no CDN. The page reads the admin API with the operator's token and acts through it.
"""
