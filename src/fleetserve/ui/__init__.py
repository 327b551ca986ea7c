"""The web dashboard's files: the HTML shell and login page, and the static scripts and styles
``fleetserve.server.admin.ui`` serves at /ui. Written here, no build step, nothing from the internet."""
