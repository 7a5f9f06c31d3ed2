"""Reports people look at: HTML with embedded plots."""

from gpuplane.report.html import occupancy_histogram, summary_rows, write_report

__all__ = ["occupancy_histogram", "summary_rows", "write_report"]
