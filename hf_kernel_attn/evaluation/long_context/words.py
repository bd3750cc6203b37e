"""A fixed list of common, distinct English nouns: the keys of niah and the values of kv_recall."""

WORDS = (
    "apple", "river", "candle", "garden", "window", "pencil", "mountain", "rabbit", "silver", "blanket",
    "harbor", "violin", "lantern", "meadow", "copper", "basket", "thunder", "orchard", "pepper", "marble",
    "falcon", "ribbon", "island", "hammer", "saddle", "cactus", "walnut", "compass", "velvet", "feather",
    "kettle", "glacier", "parrot", "tunnel", "ladder", "crystal", "meteor", "bridge", "canyon", "dolphin",
    "helmet", "jacket", "lemon", "mirror", "needle", "oyster", "pillow", "quartz", "rocket", "spider",
    "tomato", "umbrella", "valley", "wagon", "yogurt", "zebra", "anchor", "barrel", "cabin", "desert",
    "engine", "forest", "guitar", "hollow", "insect", "jungle", "kitten", "lizard", "magnet", "noodle",
    "ocean", "palace", "quiver", "raven", "shadow", "temple", "uniform", "vessel", "whistle", "almond",
    "beacon", "butter", "castle", "dragon", "emerald", "fountain", "goblin", "hazel", "iris", "jasmine",
    "kayak", "lobster", "maple", "nectar", "olive", "panther", "quail", "ruby", "sapphire", "tulip",
    "unicorn", "vanilla", "willow", "badger", "cobalt", "daisy", "ember", "ferret", "ginger", "hornet",
    "ivory", "jigsaw", "koala", "lotus", "mango", "nutmeg", "onion", "peach", "quill", "radish", "salmon",
    "thistle", "turnip", "vulture", "walrus", "bamboo", "cherry", "donkey", "eagle", "fig", "garlic", "hippo",
    "igloo", "jelly", "kiwi", "llama", "melon", "nickel", "otter", "pumpkin", "rhino", "sparrow", "tiger",
    "urchin", "viper", "wolf", "acorn", "bison", "cocoa", "dune", "elk", "flint", "grape", "heron", "inkwell",
    "jade", "kelp", "lime", "moss", "nugget", "opal", "plum", "reef", "sage", "tide", "vine", "wheat", "yarn",
    "zinc", "amber", "bell", "clover", "drum", "fern", "goat", "harp", "ink", "jar", "kite", "lark", "mint",
    "nest", "oak", "pine", "quilt", "rose", "seal", "thorn", "veil", "wasp", "yak",
)
