"""The book's own machinery, above every other layer: what the chapters need that a student's coursework copy does
not (exercise checkers today; toy models, studies and diagrams as the layout redesign moves them here). A coursework
copy may delete this folder."""
