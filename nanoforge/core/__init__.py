"""The base layer every part stands on: errors, config, devices and precision, files, locks, JSON."""
