"""Wire formats: the request schema and its validation (``request``), bodies and forms
(``bodies``), the native JSON API and the hook contract every API follows (``protocol``), the
OpenAI Images API (``openai_images``), which API a URL path reaches (``routes``), input images
(``input_image``) and encoded images and bodies (``encode``). Knows nothing of the engine."""
