"""Reading a store for people: log and show, diff and plot, usage, verify, and the history page (page/)."""
