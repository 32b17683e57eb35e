from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
router = APIRouter(tags=["dashboard"])


@router.get("/", include_in_schema=False)
def dashboard() -> FileResponse:
    """The live dashboard (static page; it reads the API from the browser)."""
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})
