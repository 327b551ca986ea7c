"""The operators' admin API (``/api/v1``, an admin token or the dashboard's session): the routes by
resource (``routes``), applying documents (``apply``), usage and audit records (``records``,
``audit``, ``retention``), and the web dashboard with its login (``ui``, ``loginthrottle``)."""
