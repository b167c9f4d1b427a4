"""The loss mixture: histograms of normalised losses (histogram) and the BMM / GMM fits on them
(fit): pure numpy."""
