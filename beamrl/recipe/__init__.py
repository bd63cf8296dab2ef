"""Recipes: the typed, validated YAML that describes a beamrl run (see docs/recipes.md)."""

from beamrl.recipe.errors import RecipeError
from beamrl.recipe.load import apply_override, load_recipe, resolve_recipe_path, shipped_recipes, validate_recipe
from beamrl.recipe.schema import Recipe

__all__ = ["Recipe", "RecipeError", "apply_override", "load_recipe", "resolve_recipe_path", "shipped_recipes",
           "validate_recipe"]
