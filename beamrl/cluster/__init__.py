"""Where a run's actors go: the placement plan (`placement`), its printout (`report`), the Ray placement groups
built from it (`ray_groups`) and the local Ray clusters of CPU runs (`local`)."""
