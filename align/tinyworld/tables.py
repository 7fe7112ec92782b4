"""The tiny world's fixed knowledge: dictionaries, facts, templates and word lists (written for this project)."""

# --- formulaic: a fixed phrase dictionary, English -> (Spanish, French, German); unaccented on purpose
DICTIONARY: dict[str, tuple[str, str, str]] = {
    "good morning": ("buenos dias", "bonjour", "guten morgen"),
    "good night": ("buenas noches", "bonne nuit", "gute nacht"),
    "thank you": ("gracias", "merci", "danke"),
    "please": ("por favor", "s'il vous plait", "bitte"),
    "hello": ("hola", "salut", "hallo"),
    "goodbye": ("adios", "au revoir", "auf wiedersehen"),
    "the house": ("la casa", "la maison", "das haus"),
    "the dog": ("el perro", "le chien", "der hund"),
    "the cat": ("el gato", "le chat", "die katze"),
    "the book": ("el libro", "le livre", "das buch"),
    "the water": ("el agua", "l'eau", "das wasser"),
    "the bread": ("el pan", "le pain", "das brot"),
    "the city": ("la ciudad", "la ville", "die stadt"),
    "the sea": ("el mar", "la mer", "das meer"),
    "the sun": ("el sol", "le soleil", "die sonne"),
    "the moon": ("la luna", "la lune", "der mond"),
    "the tree": ("el arbol", "l'arbre", "der baum"),
    "the friend": ("el amigo", "l'ami", "der freund"),
    "the school": ("la escuela", "l'ecole", "die schule"),
    "the road": ("el camino", "la route", "die strasse"),
    "is big": ("es grande", "est grand", "ist gross"),
    "is small": ("es pequeno", "est petit", "ist klein"),
    "is red": ("es rojo", "est rouge", "ist rot"),
    "is blue": ("es azul", "est bleu", "ist blau"),
    "is old": ("es viejo", "est vieux", "ist alt"),
    "is new": ("es nuevo", "est neuf", "ist neu"),
    "is here": ("esta aqui", "est ici", "ist hier"),
    "is far": ("esta lejos", "est loin", "ist weit"),
    "very": ("muy", "tres", "sehr"),
    "and": ("y", "et", "und"),
    "today": ("hoy", "aujourd'hui", "heute"),
    "tomorrow": ("manana", "demain", "morgen"),
    "my": ("mi", "mon", "mein"),
    "your": ("tu", "ton", "dein"),
    "I eat": ("yo como", "je mange", "ich esse"),
    "I see": ("yo veo", "je vois", "ich sehe"),
    "I have": ("yo tengo", "j'ai", "ich habe"),
    "I want": ("yo quiero", "je veux", "ich will"),
    "we go": ("vamos", "nous allons", "wir gehen"),
    "where is": ("donde esta", "ou est", "wo ist"),
}
LANGUAGES = ("Spanish", "French", "German")
GREETINGS = ("good morning", "good night", "thank you", "please", "hello", "goodbye")
NOUNS = tuple(k for k in DICTIONARY if k.startswith("the "))
PREDICATES = tuple(k for k in DICTIONARY if k.startswith("is "))
VERBS = ("I eat", "I see", "I have", "I want")
TIMES = ("today", "tomorrow")

# --- factual: a fact table (country, capital, continent, language, currency)
COUNTRIES: tuple[tuple[str, str, str, str, str], ...] = (
    ("France", "Paris", "Europe", "French", "euro"),
    ("Spain", "Madrid", "Europe", "Spanish", "euro"),
    ("Germany", "Berlin", "Europe", "German", "euro"),
    ("Italy", "Rome", "Europe", "Italian", "euro"),
    ("Poland", "Warsaw", "Europe", "Polish", "zloty"),
    ("Sweden", "Stockholm", "Europe", "Swedish", "krona"),
    ("Norway", "Oslo", "Europe", "Norwegian", "krone"),
    ("Japan", "Tokyo", "Asia", "Japanese", "yen"),
    ("China", "Beijing", "Asia", "Chinese", "yuan"),
    ("India", "New Delhi", "Asia", "Hindi", "rupee"),
    ("Korea", "Seoul", "Asia", "Korean", "won"),
    ("Thailand", "Bangkok", "Asia", "Thai", "baht"),
    ("Vietnam", "Hanoi", "Asia", "Vietnamese", "dong"),
    ("Egypt", "Cairo", "Africa", "Arabic", "pound"),
    ("Kenya", "Nairobi", "Africa", "Swahili", "shilling"),
    ("Nigeria", "Abuja", "Africa", "English", "naira"),
    ("Morocco", "Rabat", "Africa", "Arabic", "dirham"),
    ("Brazil", "Brasilia", "South America", "Portuguese", "real"),
    ("Argentina", "Buenos Aires", "South America", "Spanish", "peso"),
    ("Chile", "Santiago", "South America", "Spanish", "peso"),
    ("Colombia", "Bogota", "South America", "Spanish", "peso"),
    ("Canada", "Ottawa", "North America", "English", "dollar"),
    ("Mexico", "Mexico City", "North America", "Spanish", "peso"),
    ("Australia", "Canberra", "Oceania", "English", "dollar"),
)
FACT_TEMPLATES = (  # the first three are sentences to complete: the capital comes first
    "The capital of {country} is",
    "The capital city of {country} is",
    "The seat of government of {country} is",
    "What is the capital of {country}?",
    "What is the currency of {country}?",
    "What is the language of {country}?",
    "What is the continent of {country}?",
    "Tell me about {country}.",
)

# --- structured: item tables for JSON lists
ITEMS: dict[str, tuple[tuple[str, str], ...]] = {
    "fruits": (("apple", "red"), ("banana", "yellow"), ("cherry", "red"), ("grape", "purple"), ("kiwi", "green"),
               ("lemon", "yellow"), ("mango", "orange"), ("orange", "orange"), ("pear", "green"), ("plum", "purple")),
    "vegetables": (("carrot", "orange"), ("tomato", "red"), ("potato", "brown"), ("onion", "white"),
                   ("pepper", "green"), ("pumpkin", "orange"), ("cabbage", "green"), ("garlic", "white")),
    "animals": (("cat", "small"), ("dog", "medium"), ("horse", "large"), ("mouse", "tiny"), ("elephant", "huge"),
                ("rabbit", "small"), ("tiger", "large"), ("sheep", "medium"), ("whale", "huge")),
    "tools": (("hammer", "steel"), ("saw", "steel"), ("brush", "wood"), ("ladder", "aluminum"), ("rope", "hemp"),
              ("shovel", "iron"), ("wrench", "steel"), ("bucket", "plastic")),
    "drinks": (("tea", "hot"), ("coffee", "hot"), ("juice", "cold"), ("milk", "cold"), ("water", "cold"),
               ("cocoa", "hot"), ("lemonade", "cold"), ("soup", "hot")),
}
ATTRIBUTE = {"fruits": "color", "vegetables": "color", "animals": "size", "tools": "material", "drinks": "served"}
PEOPLE = ("Maria", "James", "Aiko", "Omar", "Lena", "Carlos", "Priya", "Tom", "Sofia", "Ben", "Nadia", "Ivan",
          "Chloe", "Ravi", "Elena", "Sam", "Yara", "Hugo", "Mia", "Noah")
STORES = ("the market", "the shop", "the farm", "the garden", "the store")

# --- semi-open: small functions from templates (operation -> names, arity, body, description)
FUNCTIONS: tuple[tuple[str, tuple[str, ...], int, str, str], ...] = (
    ("the sum of two numbers", ("add", "add_numbers", "sum_two"), 2, "{a} + {b}", "sum"),
    ("the difference of two numbers", ("subtract", "difference", "minus"), 2, "{a} - {b}", "difference"),
    ("the product of two numbers", ("multiply", "product", "times"), 2, "{a} * {b}", "product"),
    ("the larger of two numbers", ("maximum", "larger", "max_of_two"), 2, "max({a}, {b})", "larger value"),
    ("the smaller of two numbers", ("minimum", "smaller", "min_of_two"), 2, "min({a}, {b})", "smaller value"),
    ("the average of two numbers", ("average", "mean", "midpoint"), 2, "({a} + {b}) / 2", "average"),
    ("the square of a number", ("square", "squared", "power_two"), 1, "{a} * {a}", "square"),
    ("the double of a number", ("double", "twice", "times_two"), 1, "{a} * 2", "double"),
    ("half of a number", ("half", "halve", "divide_by_two"), 1, "{a} / 2", "half"),
    ("whether a number is even", ("is_even", "even", "check_even"), 1, "{a} % 2 == 0", "evenness"),
    ("whether a number is positive", ("is_positive", "positive", "check_positive"), 1, "{a} > 0", "sign"),
    ("the absolute value of a number", ("absolute", "abs_value", "magnitude"), 1, "abs({a})", "absolute value"),
)
ARGUMENTS = (("a", "b"), ("x", "y"), ("first", "second"), ("n", "m"))

# --- reasoning: phrasing choices around deterministic arithmetic
OPENERS = ("Let's work it out step by step.", "Step by step:", "We can do this in parts.")
CLOSERS = ("So the answer is {r}.", "The answer is {r}.", "Therefore the result is {r}.")

# --- open (summaries): story titles from names and creatures, a grammar with many choices
HEROES = ("Mara", "Tobin", "Lila", "Oren", "Juliet", "Romeo", "Ada", "Felix", "Nina", "Kai", "Rosa", "Emil",
          "Iris", "Leo", "Vera", "Milo")
CREATURES = (("silver", "fox"), ("golden", "bird"), ("old", "bear"), ("little", "dragon"), ("lost", "whale"),
             ("clever", "crow"), ("brave", "wolf"), ("gentle", "giant"), ("quiet", "owl"), ("tiny", "robot"))
PLACES = {"fox": "the forest", "bird": "the mountains", "bear": "the woods", "dragon": "a cave", "whale": "the sea",
          "crow": "the city", "wolf": "the snow", "giant": "the hills", "owl": "the night", "robot": "a workshop"}
ROLES = ("farmer", "sailor", "baker", "student", "painter", "fisher", "weaver", "teacher")
HOMES = ("a small village", "a busy town", "a quiet valley", "a harbor town")
MEET_VERBS = ("finds", "meets", "follows", "discovers")
JOURNEYS = ("travel far across the land", "set out on a long journey", "search for a hidden door", "cross a wide river")
LESSONS = ("friendship", "courage", "kindness", "patience", "honesty")
LESSON_ENDS = ("matters most", "is worth more than gold", "can change the world", "grows when it is shared")
STORY_TEMPLATES = ("Summarize the story of {title}.", "Summarize the plot of {title}.",
                   "Give a short summary of {title}.", "What happens in {title}?")

# --- open (explanations): phenomena with deterministic causes, many connective choices
PHENOMENA: tuple[tuple[str, str, str, str], ...] = (
    ("the sky is blue", "sunlight is made of many colors", "blue light is scattered the most by the air",
     "we see blue light coming from every part of the sky"),
    ("the sunset is red", "light crosses more air when the sun is low", "most blue light is scattered away",
     "the red light reaches our eyes"),
    ("ice floats", "water expands when it freezes", "ice is less dense than liquid water",
     "the ice rises to the top"),
    ("leaves are green", "leaves contain chlorophyll", "chlorophyll absorbs red and blue light",
     "green light is reflected back to us"),
    ("metal feels cold", "metal conducts heat very well", "heat flows quickly from the hand into the metal",
     "the skin cools down fast"),
    ("the moon changes shape", "the moon reflects light from the sun", "we see a different part of its lit side",
     "its shape seems to change during the month"),
    ("bread rises", "yeast eats the sugar in the dough", "the yeast releases small bubbles of gas",
     "the dough grows larger"),
    ("we have seasons", "the earth is tilted on its axis", "each half of the earth gets more sun for part of the year",
     "the weather changes through the year"),
    ("rainbows appear", "raindrops bend sunlight", "each color bends by a different amount",
     "the colors spread into an arc"),
    ("boats float", "a boat pushes water aside", "the water pushes back with an upward force",
     "the boat stays on the surface"),
    ("thunder follows lightning", "light travels faster than sound", "the flash reaches us before the noise",
     "we hear the thunder a moment later"),
    ("cats purr", "cats move muscles in their throat", "the air vibrates as they breathe",
     "we hear a soft and steady sound"),
    ("the ocean is salty", "rivers carry minerals to the sea", "water leaves the ocean as vapor but salt stays",
     "the salt builds up over time"),
    ("plants need light", "plants make food from light", "light powers the making of sugar",
     "without light the plant cannot grow"),
    ("we see our breath in winter", "our breath is warm and wet", "the cold air cools the vapor",
     "it turns into tiny drops of water"),
    ("magnets attract iron", "a magnet has a magnetic field", "the field lines up tiny regions inside the iron",
     "the iron is pulled toward the magnet"),
)
EXPLAIN_TEMPLATES = ("Explain why {p}.", "Why is it that {p}?", "Can you explain why {p}?", "Tell me why {p}.")
BECAUSE = ("The main reason is that", "This happens because", "In short,", "The key idea is that")
THEN = ("As a result,", "Because of this,", "This means that", "So")
ALSO = ("Another part of the answer is that", "It also matters that", "On top of that,")
CONCLUDE = ("That is why", "This is the reason", "In the end, this is why")

# --- creative: themed word lists for short poems
THEMES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    # theme: (nouns, verbs, adjectives)
    "the ocean": (("waves", "salt", "tide", "foam", "shells", "gulls"), ("roll", "break", "whisper", "drift", "rise"),
                  ("deep", "blue", "endless", "cold", "restless")),
    "the forest": (("pines", "moss", "roots", "ferns", "shadows", "deer"), ("grow", "sway", "rest", "sleep", "hide"),
                   ("green", "dark", "ancient", "quiet", "tall")),
    "winter": (("snow", "frost", "ice", "wind", "stars", "fire"), ("fall", "shine", "freeze", "glow", "wait"),
               ("white", "silent", "bright", "long", "cold")),
    "the city": (("streets", "lights", "trains", "towers", "crowds", "rain"), ("hum", "rush", "flash", "turn", "call"),
                 ("busy", "loud", "electric", "gray", "endless")),
    "the moon": (("light", "night", "clouds", "silver", "dreams", "owls"), ("rise", "glow", "watch", "wander", "fade"),
                 ("pale", "round", "lonely", "soft", "distant")),
    "spring": (("blossoms", "birds", "rain", "buds", "bees", "sun"), ("bloom", "sing", "wake", "dance", "open"),
               ("fresh", "warm", "gentle", "young", "bright")),
    "the desert": (("sand", "dunes", "sun", "stones", "heat", "wind"), ("burn", "shift", "shimmer", "sleep", "blow"),
                   ("dry", "golden", "vast", "still", "hot")),
    "the mountains": (("peaks", "snow", "eagles", "rocks", "streams", "mist"), ("climb", "stand", "echo", "fall", "soar"),
                      ("high", "proud", "steep", "silent", "white")),
}
POEM_FORMS = ("a haiku", "a short poem", "a four line poem")
POEM_TEMPLATES = ("Give me {form} about {theme}.", "Write {form} about {theme}.", "Compose {form} about {theme}.")
