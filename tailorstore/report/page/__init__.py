"""The store's history as one offline page (``tailor report``): five parts, each one chart's data.

The data (:func:`~tailorstore.report.page.data.report_data`) is built from the same read paths as
``log``, ``usage``, ``diff`` and ``show``, so the page says what those commands say; the HTML
(:mod:`~tailorstore.report.page.render`) is a template file filled with that data as JSON and with
plotly.js inlined, so the file opens with no network.
"""

from tailorstore.report.page.data import report_data
from tailorstore.report.page.facts import GcOutlook, HistoryFacts, RunFacts
from tailorstore.report.page.render import ReportResult, write_report

__all__ = ["GcOutlook", "HistoryFacts", "ReportResult", "RunFacts", "report_data", "write_report"]
