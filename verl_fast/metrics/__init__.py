"""Step metrics: the loggers, the reward plot and the OpenMetrics gauges (logger), the endpoint's
HTTP server (http_server)."""
